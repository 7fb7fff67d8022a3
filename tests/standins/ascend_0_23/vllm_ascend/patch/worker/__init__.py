"""Stand-in package (upstream imports the worker patches in NPUWorker.__init__)."""

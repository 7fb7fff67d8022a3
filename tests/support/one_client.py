"""A DumpScheduler that is also its one connector's DumpClient, for tests that play one
connector: the save side and the request side are called on one name.

The scheduler itself has no request methods (every connector holds its own client); this
binds a client's onto the instance, so nothing forwards at run time.
"""

from __future__ import annotations

from typing import Any

from ucm_patch.hooks.dump import DumpScheduler


class OneClientScheduler(DumpScheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.dumps = self.client("test")
        self.open_batch = self.dumps.open_batch
        self.get_finished = self.dumps.get_finished
        self.handle_preemptions = self.dumps.handle_preemptions
        self.needs_delayed_free = self.dumps.needs_delayed_free

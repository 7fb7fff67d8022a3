"""Verification engine: patch records against the real source of their target library.

A release's source is *read* with :mod:`ast`, never imported, so one machine checks every
release of vLLM and vLLM-Ascend (torch-npu or CUDA need not run here). Each record states
what it relies on in ``expect`` (:mod:`ucm_patch.source_checks`); this package evaluates
those checks and renders the verification matrices of docs/PATCHES.md.

=========  ===================================================================================
module     holds
=========  ===================================================================================
source     the source-tree model: modules parsed on first use, definition lookups, the one
           parameter reader, small ``ast`` helpers
check_r.   (``check_runner``) the checks runner (one evaluator per check kind) and version
           gating
sections   the generated sections of docs/PATCHES.md (``<!-- name:start -->`` ... ``end``)
vllm       vLLM: wheel sources, extracted signature facts, verdicts, the matrix
ascend     vLLM-Ascend: the checks of one source tree, completeness, facts and results
ascend_s.  (``ascend_sources``) vLLM-Ascend sources: PyPI wheels and sdist, git archive
ascend_r.  (``ascend_report``) vLLM-Ascend results: the data file and the docs matrix
=========  ===================================================================================

``scripts/verify_targets.py`` and ``scripts/verify_ascend_targets.py`` are the command
lines over it; the tests import it. It is not installed with ucm_patch (issue #28): a
serving process never needs pip, venvs or release archives. Importing it costs the
standard library and ``packaging``: the patch records are imported the first time a
function needs them.
"""

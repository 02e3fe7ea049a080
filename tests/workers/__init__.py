"""Programs the tests start as subprocesses (never collected as tests), run from the repo root.

``corpus_worker`` (``python -m tests.workers.corpus_worker``): one command over the whole
adversarial corpus, a fork per file. ``crash_worker`` (``python -m tests.workers.crash_worker``):
real writes SIGKILLed at random moments. ``dist_worker`` (by path, one process per rank): a
gloo training run of the training API. ``resume_worker`` (by path): a training run killed and
resumed. Their names keep the ``_worker`` suffix: a script run by path puts this folder first
on ``sys.path``, where a plain name (``resume``, ``crash``) could shadow an installed module.
"""

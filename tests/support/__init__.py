"""What the tests share, and the one part of ``tests/`` that code outside it may import.

Helper modules and case builders, no tests: ``helpers`` (the fixture list, a torch-side
flattening to compare against), ``adversarial`` (hostile inputs; ``python -m
tests.support.adversarial DIR`` writes the corpus), ``dcp_cases`` (the DCP fixture, torch's
reading of it, damage), ``fuzz_targets`` and ``minimind``.

Two of them are an API for the folders beside ``tests/``, kept stable for them:
``fuzz_targets`` (the seeds, mutations and property that ``fuzz/fuzz_reader.py`` runs) and
``minimind`` (the MiniMind-shaped model that ``tests/fixtures/generate.py`` and ``bench/``
build checkpoints from). ``bench/`` and ``fuzz/`` import nothing else from ``tests/``.
"""

"""Reading and editing pickles without running them: the torch formats' shared pickle layer.

The modules depend one way: :mod:`~ckpttool.pickle.edit` (splicing top-level fields) on
:mod:`~ckpttool.pickle.interpreter` (the opcode walker), on :mod:`~ckpttool.pickle.policy`
(which globals are safe, unknown or dangerous), on :mod:`~ckpttool.pickle.emulation` (what the
known globals build, as data). Nothing is imported here: importing one module costs only what
it needs. Inside ckpttool, ``import pickle`` is still the standard library's (imports are
absolute).
"""

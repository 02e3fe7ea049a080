"""Reading and editing pickles without running them: the torch formats' shared pickle layer.

:mod:`~ckpttool.pickle.interpreter` walks the opcodes, :mod:`~ckpttool.pickle.policy` says what
it emulates and refuses, :mod:`~ckpttool.pickle.edit` splices top-level fields. Nothing is
imported here: importing one module costs only what it needs. Inside ckpttool, ``import pickle``
is still the standard library's (imports are absolute).
"""

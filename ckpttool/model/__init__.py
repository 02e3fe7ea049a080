"""The data model, on the ground floor: what a checkpoint holds, named and counted one way.

The object tree and its records (:mod:`~ckpttool.model.records`: tensors, storages, opaque
objects), the classes kept as data records
(:mod:`~ckpttool.model.data_records`), roles (:mod:`~ckpttool.model.roles`: what kind of
checkpoint a tree is, what its parts are for), the names every ``--json`` output uses
(:mod:`~ckpttool.model.vocabulary`), dtype casts (:mod:`~ckpttool.model.cast`), LR schedulers'
counters (:mod:`~ckpttool.model.lr_schedule`) and how sizes, counts and values are written
(:mod:`~ckpttool.model.text`). Pure data and functions: no file access, no torch; it imports
nothing of ckpttool but :mod:`ckpttool.errors` and itself.
"""

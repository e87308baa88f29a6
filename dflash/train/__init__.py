"""Draft training: target-regenerated data (:mod:`~dflash.train.data`), the block layout and
masks (:mod:`~dflash.train.masks`), the objective (:mod:`~dflash.train.objective`) and the loop
(:mod:`~dflash.train.train`). Commands: ``dflash data regenerate`` and ``dflash train``.
"""

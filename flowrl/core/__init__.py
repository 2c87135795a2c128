"""What every layer of flowrl uses, importing no other flowrl package (beside :mod:`flowrl.errors` and
:mod:`flowrl.paths`): seeds derived from names (:mod:`~flowrl.core.seeding`), the registry that names components,
rewards, kernels and model families (:mod:`~flowrl.core.registry`) and the checked choices of their settings
(:mod:`~flowrl.core.choices`). tests/test_layers.py holds the layers."""

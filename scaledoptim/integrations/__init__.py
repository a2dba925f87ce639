"""Training frameworks that drive scaledoptim for you.

* :mod:`scaledoptim.integrations.lightning`: :class:`ScaledMixedPrecision`, a Lightning
  precision plugin (needs the ``lightning`` extra).
* :mod:`scaledoptim.integrations.accelerate`: :func:`unwrap_optimizer`, reaching scaledoptim's
  methods through Accelerate's optimizer wrapper.
* :mod:`scaledoptim.integrations.transformers`: :class:`ScaledTrainer`, a ``transformers.Trainer``
  that autocasts and scales with scaledoptim on any device (needs the ``examples-hf`` and
  ``accelerate`` extras).
* :mod:`scaledoptim.integrations.timm`: :class:`NativeScaler`, timm's loss scaler whose scale is
  the optimizer's and whose clip by norm is inside the step (imports no timm).

Nothing here is imported until you import its module, so ``import scaledoptim`` never needs
Lightning, Accelerate or transformers.
"""

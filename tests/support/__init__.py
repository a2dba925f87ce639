"""Helpers the tests share; no tests here (a ``test_*.py`` module never imports another).

* :mod:`tests.support.training`: a small model, its batches and loss, bit-level snapshots of an
  optimizer.
* :mod:`tests.support.references`: a row's reference step (``torch.optim``'s class, or the
  optimizer's own torch form in float64) from an optimizer's current state, and the tolerances
  results are held to.
* :mod:`tests.support.tensors`: tensors that cross every chunk boundary of the kernels, misaligned
  views, byte-level comparisons.
* :mod:`tests.support.launches`: a row's update launched on our kernels as the kernel backend
  launches it, built from the class's :class:`~scaledoptim.fused.update.Update` hooks; the
  names of the kernels a block launched (``recorded_launches``).
* :mod:`tests.support.gpu`: the marks of the tests that need a CUDA device and CuPy.
* :mod:`tests.support.cases`: many cheap, alike cases in one test that fails naming each failing
  case.

Every optimizer these helpers see comes from a row of :mod:`scaledoptim.testing.optim_db`.
"""

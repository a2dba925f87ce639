"""Entry point of ``python -m scaledoptim.doctor`` (see :mod:`scaledoptim.doctor.cli`)."""

from .cli import main

raise SystemExit(main())

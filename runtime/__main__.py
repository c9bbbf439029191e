"""``torchrun --nproc-per-node N -m runtime PLAN --steps K``: see runtime/command.py."""

from runtime.command import main

raise SystemExit(main())

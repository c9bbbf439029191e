"""``torchrun --nproc-per-node N -m runtime PLAN --steps K``: see runtime/launch.py."""

from runtime.launch import main

raise SystemExit(main())

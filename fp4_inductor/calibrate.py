"""``python -m fp4_inductor.calibrate``: the command line of ``fp4_inductor.calibrate()``
(``calibration.py``; ``--help`` lists the options)."""

from .calibration import main

if __name__ == "__main__":
    raise SystemExit(main())

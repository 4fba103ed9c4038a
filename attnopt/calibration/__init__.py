"""Calibration (attention transfer): make a compiled model's rewritten sites reproduce its original
attention on more data than compile saw, on one process or many, and re-verify on held-out data."""

from attnopt.calibration.calibrate import Calibration, calibrate
from attnopt.ir.errors import CalibrationError

__all__ = ["calibrate", "Calibration", "CalibrationError"]

"""Unit constants: durations are in seconds (trio's unit), sizes in bytes."""

SECONDS = 1.0
MILLISECONDS = 1e-3
MICROSECONDS = 1e-6
KIB = 1024
MIB = 1024 * KIB

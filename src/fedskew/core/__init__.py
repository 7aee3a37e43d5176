"""Leaves every layer uses: errors, randomness, precision, devices, the machine's facts,
durable files and locks."""

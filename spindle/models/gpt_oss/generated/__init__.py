"""Written by `spindle patchgen` from ../patches.py; never edit by hand (`spindle patchgen --check` fails)."""

"""`python -m neuron_app.selftest`: how the selftest starts each check's process (`--worker ...`)."""

import sys

from neuron_app.selftest import main

if __name__ == "__main__":
    sys.exit(main())

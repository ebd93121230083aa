import sys

from jaxserve.sim.cli import main

sys.exit(main())

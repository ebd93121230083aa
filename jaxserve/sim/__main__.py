import sys

from jaxserve.tools.simulate import main

sys.exit(main())

import sys

from .faults import main

sys.exit(main())

import sys

from lloyal.cli import main

sys.exit(main())

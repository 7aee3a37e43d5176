import sys

from fedskew.cli import main

sys.exit(main())

import sys

from fedskew.apps.cli import main

sys.exit(main())

import sys

from ftjob.cli import main

sys.exit(main())

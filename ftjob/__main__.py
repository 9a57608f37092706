import sys

from ftjob.cli.commands import main

sys.exit(main())

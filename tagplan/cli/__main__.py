"""`python -m tagplan.cli`: the `tagplan` command."""

import sys

from tagplan.cli.main import main

sys.exit(main())

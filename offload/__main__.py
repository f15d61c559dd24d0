import sys

from offload.cli.main import main

sys.exit(main())

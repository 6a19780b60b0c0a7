import sys

from storaged.cli import main

sys.exit(main())

import sys

from tiderl.cli import main

sys.exit(main())

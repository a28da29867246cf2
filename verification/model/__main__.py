import sys

from verification.model import main

sys.exit(main())

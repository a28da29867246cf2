import sys

from poimen._model import main

sys.exit(main())

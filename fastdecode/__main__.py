import sys

from fastdecode.cli import main

sys.exit(main())

import sys

from llmgw.services.cli import main

sys.exit(main())

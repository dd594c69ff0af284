import sys
from vllm_fleet.commands.cli import main

sys.exit(main())

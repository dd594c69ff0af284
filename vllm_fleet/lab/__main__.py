import sys

from vllm_fleet.lab import main

sys.exit(main())

import sys

from dynamod.workers.cpu.serve import main

sys.exit(main())

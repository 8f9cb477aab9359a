import sys

from scheduler_svc.main import main

sys.exit(main())

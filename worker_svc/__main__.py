import sys

from worker_svc.main import main

sys.exit(main())

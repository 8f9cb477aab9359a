import sys

from scheduler_svc.data_parallel.main import main

sys.exit(main())

import sys

from qpass.apps.study.run import main

sys.exit(main())

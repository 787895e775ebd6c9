import sys

from cocoon_ckpt._cli.main import main

sys.exit(main())

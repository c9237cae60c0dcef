import sys

from hf_specdec.cli import main

sys.exit(main())

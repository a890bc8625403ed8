from kvbm.testing.tiny_model import *  # noqa: F401,F403
from kvbm.testing.tiny_model import QWEN2_05B_LIKE, make_tiny_model  # noqa: F401

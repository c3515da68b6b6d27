"""Full fine-tuning: every backbone parameter trains (the frozen head sits outside the params).

Ilharco et al., "Editing Models with Task Arithmetic", ICLR 2023.
"""

from editing.regimes.base import Regime

FULL = Regime('full')

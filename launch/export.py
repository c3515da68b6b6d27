r"""Writes a merged model as a Hugging Face directory (`merging.jobs.export`).

  python -m launch.export --config=configs/clip_8task.py:vit_b32 --workdir=workdir/clip_b32 \
      --config.export.method=ties --config.export.output=/models/clip-b32-ties
"""

from configs import clip_8task
from editing.jobs import cli
from merging.jobs import export

if __name__ == '__main__':
  cli.run(export.run, clip_8task)

"""The detection server behind `python -m deformable_detr.serve` (the `serve` extra: Starlette, uvicorn,
python-multipart): `app.py` the routes, `batcher.py` the batching on one worker thread, `uploads.py`
the uploaded images, `static/` the page served at /."""

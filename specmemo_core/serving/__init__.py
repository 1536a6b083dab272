"""``specmemo serve``: the loaded model on localhost through the OpenAI API (scheduler, formats, routes)."""

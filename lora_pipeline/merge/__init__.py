"""merge's check of the merged model against the adapted one: weight by weight, and by logits."""

"""NxD's own training-tag format: its optimizer files read (per (tp, pp) rank, per ep rank) and written, seen as an
optimizer source of a plan, and the side files and training position NxD's trainers record beside them."""

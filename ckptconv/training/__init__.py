"""Training state: optimizer formats (nxdtrain's, NxD's own, read and written), how they ride a plan,
training positions and schedules, the side files each trainer resumes from, and a tag reshard split into parts.
"""

"""Test helpers: tiny random-weight models (`tiny`), a scripted drafter (`oracle`), service fixtures (`servicekit`)."""

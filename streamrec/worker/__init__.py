"""streamrec.worker"""

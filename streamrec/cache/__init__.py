"""streamrec.cache"""

package object

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/minio/minio-go/v7"

	"github.com/kvbm/kvbm/goext/fingerprint"
)

// Purge and expiry of G4 objects (docs/g4.md, "Purge and expiry").

// PurgeResult counts what one purge or sweep pass did in the bucket.
type PurgeResult struct {
	Listed  int // objects listed (a sweep: examined)
	Deleted int // objects deleted
	Failed  int // deletes that failed (the first error is returned)
}

// purgeDeletes bounds the DELETE requests of one purge in flight.
const purgeDeletes = 16

// listPage is the most keys one ListObjects request asks for.
const listPage = 1000

// ErrPurgeAll guards PurgeAll against a caller that did not mean it.
var ErrPurgeAll = errors.New("object: purge of every G4 object needs all=true")

// PurgeSalt deletes every object of salt hash salt, for every fingerprint
// (model, tensor-parallel rank) in the bucket: one listing of the salt's
// prefix, never of the whole bucket. Deleted hashes leave the registry. The
// default salt has no prefix of its own: purging it is an error (purge the
// prefixes, or everything).
func (s *Store) PurgeSalt(ctx context.Context, salt uint64) (PurgeResult, error) {
	prefix := s.SaltPrefix(salt)
	if prefix == "" {
		return PurgeResult{}, errors.New("object: purge of the default salt (no cache salt, no LoRA): " +
			"its objects share the unsalted keys; purge prefixes or everything instead")
	}
	return s.purgeListed(ctx, prefix)
}

// PurgeAll deletes every object of this format in the bucket (every model,
// salt and rank: the whole fleet's G4), and empties the registry of what it
// deleted. all must be true.
func (s *Store) PurgeAll(ctx context.Context, all bool) (PurgeResult, error) {
	if !all {
		return PurgeResult{}, ErrPurgeAll
	}
	return s.purgeListed(ctx, KeyPrefix)
}

// PurgeHashes deletes the objects of hashes (blocks of a request of salt
// hash salt) under every fingerprint that has objects of that salt in the
// bucket: every tensor-parallel rank's shard (and any other model's copy of
// the same blocks), not only this store's. The fingerprints come from one
// listing by directory of the salt's prefix (for unsalted blocks: of the
// unsalted fingerprints, which sort before every salt's prefix), never of
// the objects themselves; this store's own fingerprint is always included.
// Listed counts the keys named.
func (s *Store) PurgeHashes(ctx context.Context, salt uint64, hashes []uint64) (PurgeResult, error) {
	if len(hashes) == 0 {
		return PurgeResult{}, nil
	}
	dirs, listErr := s.fingerprintDirs(ctx, salt)
	keys := make([]string, 0, len(dirs)*len(hashes))
	for _, d := range dirs {
		for _, h := range hashes {
			keys = append(keys, fmt.Sprintf("%s%016x", d, h))
		}
	}
	res := PurgeResult{Listed: len(keys)}
	err := s.deleteKeys(ctx, keys, &res)
	return res, errors.Join(listErr, err)
}

// maxFingerprintDirs bounds the fingerprints one prefix purge reaches.
const maxFingerprintDirs = 4096

// fingerprintDirs returns the key prefixes ("<salt prefix or KeyPrefix><fp>/")
// of every fingerprint holding objects of salt hash salt, this store's
// first: one ListObjects by directory.
func (s *Store) fingerprintDirs(ctx context.Context, salt uint64) ([]string, error) {
	parent := s.SaltPrefix(salt)
	if parent == "" {
		parent = KeyPrefix
	}
	own := parent + s.fp.String() + "/"
	dirs := []string{own}
	lctx, cancel := context.WithCancel(ctx)
	defer cancel()
	saltDirs := KeyPrefix + "s"
	for obj := range s.c.mc.ListObjects(lctx, s.c.bucket, minio.ListObjectsOptions{Prefix: parent, MaxKeys: listPage}) {
		if obj.Err != nil {
			return dirs, fmt.Errorf("object: list the fingerprints under %q in bucket %s: %w", parent, s.c.bucket, obj.Err)
		}
		k := obj.Key
		if parent == KeyPrefix && strings.HasPrefix(k, saltDirs) {
			break // salts' prefixes sort after every unsalted fingerprint
		}
		fp, ok := strings.CutPrefix(k, parent)
		if !ok || !strings.HasSuffix(fp, "/") {
			continue // an object, not a directory
		}
		if _, err := fingerprint.Parse(strings.TrimSuffix(fp, "/")); err != nil || k == own {
			continue
		}
		if len(dirs) >= maxFingerprintDirs {
			return dirs, fmt.Errorf("object: more than %d fingerprints under %q in bucket %s: purged the first %d",
				maxFingerprintDirs, parent, s.c.bucket, maxFingerprintDirs)
		}
		dirs = append(dirs, k)
	}
	return dirs, nil
}

// Sweep is one bounded pass of the expiry sweeper: it lists at most
// maxList objects of this format after startAfter (in key order) and
// deletes those last modified before now-ttl. It returns where the next
// pass starts: "" once the listing reached the end of the bucket (the next
// pass starts over).
func (s *Store) Sweep(ctx context.Context, now time.Time, ttl time.Duration, maxList int, startAfter string) (string, PurgeResult, error) {
	if ttl <= 0 || maxList < 1 {
		return "", PurgeResult{}, fmt.Errorf("object: sweep with ttl %v and at most %d objects: both must be positive", ttl, maxList)
	}
	res, next, err := s.list(ctx, KeyPrefix, now.Add(-ttl), maxList, startAfter)
	return next, res, err
}

// purgeListed deletes every object listed under prefix.
func (s *Store) purgeListed(ctx context.Context, prefix string) (PurgeResult, error) {
	res, _, err := s.list(ctx, prefix, time.Time{}, 0, "")
	return res, err
}

// list lists objects under prefix after startAfter (at most maxList; 0:
// all) and deletes those modified before before (zero: every one listed).
// It returns the last key listed when it stopped at maxList, else "".
func (s *Store) list(ctx context.Context, prefix string, before time.Time, maxList int, startAfter string) (PurgeResult, string, error) {
	var res PurgeResult
	lctx, cancel := context.WithCancel(ctx)
	defer cancel()
	page := listPage
	if maxList > 0 {
		page = min(page, maxList)
	}
	var keys []string
	last := ""
	var listErr error
	for obj := range s.c.mc.ListObjects(lctx, s.c.bucket, minio.ListObjectsOptions{
		Prefix: prefix, Recursive: true, MaxKeys: page, StartAfter: startAfter}) {
		if obj.Err != nil {
			listErr = fmt.Errorf("object: list %q in bucket %s: %w", prefix, s.c.bucket, obj.Err)
			break
		}
		res.Listed++
		last = obj.Key
		if before.IsZero() || obj.LastModified.Before(before) {
			keys = append(keys, obj.Key)
		}
		if maxList > 0 && res.Listed >= maxList {
			cancel()
			break
		}
		if len(keys) >= listPage { // delete page by page: memory stays bounded on any bucket
			if err := s.deleteKeys(ctx, keys, &res); err != nil {
				listErr = err
				break
			}
			keys = keys[:0]
		}
	}
	err := s.deleteKeys(ctx, keys, &res)
	if maxList == 0 || res.Listed < maxList || listErr != nil {
		last = ""
	}
	return res, last, errors.Join(listErr, err)
}

// deleteKeys deletes keys (purgeDeletes at a time), counting into res; a
// deleted key's hash leaves the registry.
func (s *Store) deleteKeys(ctx context.Context, keys []string, res *PurgeResult) error {
	deleted0 := res.Deleted
	var (
		mu       sync.Mutex
		firstErr error
		wg       sync.WaitGroup
		sem      = make(chan struct{}, purgeDeletes)
	)
	for _, k := range keys {
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer func() { <-sem; wg.Done() }()
			dctx, cancel := context.WithTimeout(ctx, s.timeout)
			err := s.c.Delete(dctx, k)
			cancel()
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				res.Failed++
				if firstErr == nil {
					firstErr = fmt.Errorf("object: delete %s: %w", k, err)
				}
				return
			}
			res.Deleted++
			if h, ok := KeyHash(k); ok {
				s.reg.Remove(h)
			}
		}()
	}
	wg.Wait()
	stats.purged.Add(uint64(res.Deleted - deleted0))
	return firstErr
}

// Purged is how many objects this process deleted by purges and expiry.
func Purged() uint64 { return stats.purged.Load() }
